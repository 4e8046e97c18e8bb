"""Models of every supported family (one decoder): config reading, modules, loading (folder, GGUF, Hub), tokenizers."""

from .config import ModelConfig, RopeConfig, config_from_dict, load_config
from .llama import CausalLM
from .loader import RANDOM_MODELS, ModelSource, build_model, model_config, resolve_model
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["ModelConfig", "RopeConfig", "config_from_dict", "load_config", "CausalLM", "RANDOM_MODELS",
           "ModelSource", "build_model", "model_config", "resolve_model", "Tokenizer", "load_tokenizer"]
