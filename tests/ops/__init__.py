"""Each op called directly: numbers against float64, options, bad input, TP, threads, torch.compile."""
