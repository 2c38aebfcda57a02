"""Bringing a pretrained model in: a GGUF file as a plain Hugging Face directory (`gguf`), and a tool-aware chat
template with its marker tokens for a model whose own template has no tool support (`tools`)."""
