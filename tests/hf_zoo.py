"""A zoo of small random-init Hugging Face models for the coverage suite (`tests/test_coverage.py`,
`benchmarks/coverage.py`): decoder LMs, encoder LMs, encoder-decoders, vision transformers, CNNs
and mixtures of experts. Every model is built from a config, with no download, at a size that
runs in a second on a CPU; each comes with a batch of 2 whose loss the model computes itself.

Example:
    >>> model, inputs = build("t5")
    >>> model(**inputs).loss
"""

from __future__ import annotations

from typing import Any

import torch

# One small shape for every transformer: 2 layers, width 64, 4 heads.
SMALL = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)
VOCAB = 128
SEQ = 16
BATCH = 2


# name -> (family, model class name, config class name, config overrides, input kind)
ZOO: dict[str, tuple[str, str, str, dict[str, Any], str]] = {
    # decoder LMs
    "gpt2": ("decoder", "GPT2LMHeadModel", "GPT2Config",
             dict(n_layer=2, n_embd=64, n_head=4, n_positions=64), "causal"),
    "gpt_neo": ("decoder", "GPTNeoForCausalLM", "GPTNeoConfig",
                dict(num_layers=2, hidden_size=64, num_heads=4, max_position_embeddings=64,
                     attention_types=[[["global", "local"], 1]], window_size=8), "causal"),
    "gptj": ("decoder", "GPTJForCausalLM", "GPTJConfig",
             dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, rotary_dim=8), "causal"),
    "gpt_neox": ("decoder", "GPTNeoXForCausalLM", "GPTNeoXConfig",
                 dict(SMALL, max_position_embeddings=64), "causal"),
    "llama": ("decoder", "LlamaForCausalLM", "LlamaConfig",
              dict(SMALL, num_key_value_heads=2, max_position_embeddings=64), "causal"),
    "mistral": ("decoder", "MistralForCausalLM", "MistralConfig",
                dict(SMALL, num_key_value_heads=2, max_position_embeddings=64,
                     sliding_window=8), "causal"),
    "qwen2": ("decoder", "Qwen2ForCausalLM", "Qwen2Config",
              dict(SMALL, num_key_value_heads=2, max_position_embeddings=64), "causal"),
    "qwen3": ("decoder", "Qwen3ForCausalLM", "Qwen3Config",
              dict(SMALL, num_key_value_heads=2, max_position_embeddings=64, head_dim=16),
              "causal"),
    "gemma": ("decoder", "GemmaForCausalLM", "GemmaConfig",
              dict(SMALL, num_key_value_heads=2, max_position_embeddings=64, head_dim=16),
              "causal"),
    "gemma2": ("decoder", "Gemma2ForCausalLM", "Gemma2Config",
               dict(SMALL, num_key_value_heads=2, max_position_embeddings=64, head_dim=16,
                    sliding_window=8), "causal"),
    "phi": ("decoder", "PhiForCausalLM", "PhiConfig",
            dict(SMALL, max_position_embeddings=64), "causal"),
    "phi3": ("decoder", "Phi3ForCausalLM", "Phi3Config",
             dict(SMALL, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=0), "causal"),
    "opt": ("decoder", "OPTForCausalLM", "OPTConfig",
            dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=128,
                 word_embed_proj_dim=64, max_position_embeddings=64), "causal"),
    "bloom": ("decoder", "BloomForCausalLM", "BloomConfig",
              dict(n_layer=2, hidden_size=64, n_head=4), "causal"),
    "falcon": ("decoder", "FalconForCausalLM", "FalconConfig",
               dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4), "causal"),
    "codegen": ("decoder", "CodeGenForCausalLM", "CodeGenConfig",
                dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, rotary_dim=8), "causal"),
    "stablelm": ("decoder", "StableLmForCausalLM", "StableLmConfig",
                 dict(SMALL, num_key_value_heads=2, max_position_embeddings=64), "causal"),
    "olmo": ("decoder", "OlmoForCausalLM", "OlmoConfig",
             dict(SMALL, num_key_value_heads=2, max_position_embeddings=64), "causal"),
    "starcoder2": ("decoder", "Starcoder2ForCausalLM", "Starcoder2Config",
                   dict(SMALL, num_key_value_heads=2, max_position_embeddings=64), "causal"),
    # encoder LMs
    "bert": ("encoder", "BertForMaskedLM", "BertConfig",
             dict(SMALL, max_position_embeddings=64), "masked"),
    "roberta": ("encoder", "RobertaForMaskedLM", "RobertaConfig",
                dict(SMALL, max_position_embeddings=64, pad_token_id=1), "masked"),
    "distilbert": ("encoder", "DistilBertForMaskedLM", "DistilBertConfig",
                   dict(n_layers=2, dim=64, n_heads=4, hidden_dim=128,
                        max_position_embeddings=64), "masked"),
    "albert": ("encoder", "AlbertForMaskedLM", "AlbertConfig",
               dict(SMALL, embedding_size=32, max_position_embeddings=64), "masked"),
    "electra": ("encoder", "ElectraForMaskedLM", "ElectraConfig",
                dict(SMALL, embedding_size=32, max_position_embeddings=64), "masked"),
    "deberta_v2": ("encoder", "DebertaV2ForMaskedLM", "DebertaV2Config",
                   dict(SMALL, max_position_embeddings=64, relative_attention=True,
                        position_buckets=8, pos_att_type=["p2c", "c2p"]), "masked"),
    "mpnet": ("encoder", "MPNetForMaskedLM", "MPNetConfig",
              dict(SMALL, max_position_embeddings=64), "masked"),
    "funnel": ("encoder", "FunnelForMaskedLM", "FunnelConfig",
               dict(d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1],
                    num_decoder_layers=1), "masked"),
    "convbert": ("encoder", "ConvBertForMaskedLM", "ConvBertConfig",
                 dict(SMALL, embedding_size=64, max_position_embeddings=64), "masked"),
    "fnet": ("encoder", "FNetForMaskedLM", "FNetConfig",
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=64), "masked"),
    "bert_cls": ("encoder", "BertForSequenceClassification", "BertConfig",
                 dict(SMALL, max_position_embeddings=64, num_labels=3), "classify"),
    # encoder-decoders
    "t5": ("seq2seq", "T5ForConditionalGeneration", "T5Config",
           dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0),
           "seq2seq"),
    "bart": ("seq2seq", "BartForConditionalGeneration", "BartConfig",
             dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                  max_position_embeddings=64), "seq2seq"),
    "marian": ("seq2seq", "MarianMTModel", "MarianConfig",
               dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                    max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=0),
               "seq2seq"),
    "pegasus": ("seq2seq", "PegasusForConditionalGeneration", "PegasusConfig",
                dict(d_model=64, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
                     pad_token_id=0, decoder_start_token_id=0), "seq2seq"),
    # vision transformers
    "vit": ("vision", "ViTForImageClassification", "ViTConfig",
            dict(SMALL, image_size=32, patch_size=8, num_labels=10), "image"),
    "deit": ("vision", "DeiTForImageClassification", "DeiTConfig",
             dict(SMALL, image_size=32, patch_size=8, num_labels=10), "image"),
    "beit": ("vision", "BeitForImageClassification", "BeitConfig",
             dict(SMALL, image_size=32, patch_size=8, num_labels=10,
                  use_relative_position_bias=True), "image"),
    "dinov2": ("vision", "Dinov2ForImageClassification", "Dinov2Config",
               dict(SMALL, image_size=32, patch_size=8, num_labels=10), "image"),
    "swin": ("vision", "SwinForImageClassification", "SwinConfig",
             dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                  num_heads=[2, 4], window_size=4, num_labels=10), "image"),
    # CNNs
    "resnet": ("cnn", "ResNetForImageClassification", "ResNetConfig",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                    layer_type="basic", num_labels=10), "image"),
    "convnext": ("cnn", "ConvNextForImageClassification", "ConvNextConfig",
                 dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10),
                 "image"),
    "mobilenet_v2": ("cnn", "MobileNetV2ForImageClassification", "MobileNetV2Config",
                     dict(image_size=32, depth_multiplier=0.25, num_labels=10,
                          initializer_range=0.3), "image"),
    "regnet": ("cnn", "RegNetForImageClassification", "RegNetConfig",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8,
                    num_labels=10), "image"),
    # mixtures of experts
    "mixtral": ("moe", "MixtralForCausalLM", "MixtralConfig",
                dict(SMALL, num_key_value_heads=2, max_position_embeddings=64,
                     num_local_experts=4, num_experts_per_tok=2), "causal"),
    "qwen2_moe": ("moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(SMALL, num_key_value_heads=2, max_position_embeddings=64,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64), "causal"),
    "olmoe": ("moe", "OlmoeForCausalLM", "OlmoeConfig",
              dict(SMALL, num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
                   num_experts_per_tok=2), "causal"),
}

FAMILIES = ("decoder", "encoder", "seq2seq", "vision", "cnn", "moe")


def build(name: str, dtype: torch.dtype = torch.float64, seed: int = 0, batch: int = BATCH
          ) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model `name` of the zoo, random-init in `dtype` and in eval mode (no dropout;
    BatchNorm's train mode is tested on its own), and a batch of `batch` with labels.

    Example:
        >>> model, inputs = build("resnet")
    """
    import transformers

    transformers.logging.set_verbosity_error()
    _, model_cls, config_cls, overrides, kind = ZOO[name]
    config = getattr(transformers, config_cls)(**_vocab(config_cls), **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(2, VOCAB, (batch, SEQ), generator=g)
    inputs: dict[str, torch.Tensor]
    if kind == "causal":
        inputs = {"input_ids": ids, "labels": ids}
    elif kind == "masked":
        labels = ids.clone()
        labels[:, ::3] = -100
        inputs = {"input_ids": ids, "labels": labels,
                  "attention_mask": torch.ones(batch, SEQ, dtype=torch.long).tril(SEQ // 2)}
    elif kind == "classify":
        inputs = {"input_ids": ids, "labels": torch.randint(0, 3, (batch,), generator=g)}
    elif kind == "seq2seq":
        inputs = {"input_ids": ids, "labels": torch.randint(2, VOCAB, (batch, SEQ // 2),
                                                            generator=g)}
    else:
        size = getattr(config, "image_size", 32)
        size = size if isinstance(size, int) else 32
        inputs = {"pixel_values": torch.randn(batch, 3, size, size, generator=g, dtype=dtype),
                  "labels": torch.randint(0, 10, (batch,), generator=g)}
    return model, inputs


def _vocab(config_cls: str) -> dict[str, Any]:
    if config_cls in ("ViTConfig", "DeiTConfig", "BeitConfig", "Dinov2Config", "SwinConfig",
                      "ResNetConfig", "ConvNextConfig", "MobileNetV2Config", "RegNetConfig"):
        return {}
    return {"vocab_size": VOCAB}
