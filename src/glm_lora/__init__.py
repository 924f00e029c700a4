"""glm-lora: raw text or a base model to a served chat model, as one cached Prefect DAG (docs/architecture.md)."""
