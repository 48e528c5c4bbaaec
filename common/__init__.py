"""What every pagewire service shares: server bootstrap, logging, metrics, model files."""
