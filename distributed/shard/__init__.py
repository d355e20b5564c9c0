"""What one rank holds: its layer range, the stage module, its slice of the weights."""
