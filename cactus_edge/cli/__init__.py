"""The command line: flags parsed with click, then calls into the library."""
