"""The tiny world the embedded default trains in: problems, tokenizer, model and SFT data, all made locally."""
