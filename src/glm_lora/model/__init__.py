from glm_lora.model.lora import inject_lora, lora_disabled, lora_state_dict, load_lora_state_dict, merge_lora
from glm_lora.model.model import Decoder, DecoderConfig

__all__ = ["Decoder", "DecoderConfig", "inject_lora", "lora_disabled", "lora_state_dict", "load_lora_state_dict", "merge_lora"]
