"""The pure numpy rules: acceptance, sampling, draft length, log-probabilities. Imports no llama.cpp."""
