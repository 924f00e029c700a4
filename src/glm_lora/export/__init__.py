"""Export: Hugging Face + PEFT formats (hf_peft.py), GGUF (gguf.py) and model cards (model_card.py)."""
