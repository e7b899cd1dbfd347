"""Multi-turn sessions whose history stays in the quantized cache: accuracy by turn and history depth, tool calls."""
