"""What shapes a logits row: grammars, penalties, tool calls, chat templates."""
