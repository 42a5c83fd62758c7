"""TP/PP topology: the rank grid, KV head ownership per rank and transfer plans between engines."""
