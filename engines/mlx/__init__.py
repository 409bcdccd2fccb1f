"""MLX through mlx-lm, in the application's process: see engine.MlxEngine."""
