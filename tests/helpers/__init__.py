"""What the tests share, and the op table the scripts read."""
