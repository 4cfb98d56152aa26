"""The Hugging Face transformers and verl adapters."""
