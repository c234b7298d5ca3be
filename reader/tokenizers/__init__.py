"""Tokenizers on the reader's side: the one module that loads a tokenizer library (lazily), and a Hugging Face
tokenizer's files; nothing imports them but what decodes or encodes text."""
