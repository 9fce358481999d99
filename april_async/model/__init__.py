"""The shared Llama-family model and its Hugging Face checkpoint format."""
