"""A trained pipeline as a Hugging Face causal LM: ``generate()``, ``save_pretrained``, ``from_pretrained``.

The pipeline's own layer modules (embedding, reversible blocks, final norm, head) run in order on one process,
with a Hugging Face ``DynamicCache`` handed to each block's F: generation needs no inverse, so the blocks run
their plain forward. ``GenerationMixin`` supplies ``generate()`` with its usual arguments (greedy, sampling,
``max_new_tokens``, ...). Importing this module registers both models with ``AutoConfig`` and
``AutoModelForCausalLM``::

    import petra_ds.models.causal_lm  # registers "petra_revgpt" and "petra_reversible_decoder"
    model = AutoModelForCausalLM.from_pretrained("runs/lm/hf")

A Reformer needs none of this: ``petra_ds.models.reformer.to_reformer`` gives Hugging Face's own
``ReformerModelWithLMHead``, which generates with its own cache.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .decoder import decoder_layers
from .layer_states import State, load_layer_files
from .transformer import RevGPTConfig, lm_loss, revgpt_layers


#: the output field holding the cache: ``cache`` from transformers 5.24 (``past_key_values`` warns there)
OUTPUT_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

class RevGPTLMConfig(PretrainedConfig):
    """:class:`~petra_ds.models.transformer.RevGPTConfig` as a Hugging Face config."""

    model_type = "petra_revgpt"

    def __init__(self, vocab_size: int = 256, seq_len: int = 128, d_model: int = 256, n_layers: int = 12,
                 n_heads: int = 4, mlp_ratio: int = 4, dropout: float = 0.1, tie_embeddings: bool = False,
                 grain: str = "block", **kwargs: Any) -> None:
        self.revgpt = RevGPTConfig(vocab_size, seq_len, d_model, n_layers, n_heads, mlp_ratio, dropout, tie_embeddings,
                                   grain)
        self.vocab_size, self.seq_len, self.d_model, self.n_layers = vocab_size, seq_len, d_model, n_layers
        self.n_heads, self.mlp_ratio, self.dropout, self.tie_embeddings = n_heads, mlp_ratio, dropout, tie_embeddings
        self.grain = grain
        kwargs.pop("num_hidden_layers", None)
        self.num_hidden_layers = n_layers  # generate() sizes its cache by it
        super().__init__(**kwargs)

    @classmethod
    def of(cls, config: RevGPTConfig, **kwargs: Any) -> "RevGPTLMConfig":
        return cls(**asdict(config), **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("revgpt", None)
        return out

    def layer_specs(self) -> list[LayerSpec]:
        return revgpt_layers(self.revgpt)


class DecoderLMConfig(PretrainedConfig):
    """A reversible decoder: the Hugging Face config its layers come from, kept whole under ``layers_from``, and
    its ``grain`` (``"half"``: each block is two pipeline layers)."""

    model_type = "petra_reversible_decoder"

    def __init__(self, layers_from: dict[str, Any] | None = None, grain: str = "block", **kwargs: Any) -> None:
        self.layers_from = dict(layers_from or {"model_type": "llama"})
        self.grain = grain
        kwargs.pop("num_hidden_layers", None)
        self.num_hidden_layers = self.decoder_config().num_hidden_layers  # generate() sizes its cache by it
        super().__init__(**kwargs)

    @classmethod
    def of(cls, config: PretrainedConfig, **kwargs: Any) -> "DecoderLMConfig":
        return cls(layers_from=config.to_dict(), **kwargs)

    def decoder_config(self) -> PretrainedConfig:
        values = dict(self.layers_from)
        return AutoConfig.for_model(values.pop("model_type"), **values)

    def layer_specs(self) -> list[LayerSpec]:
        return decoder_layers(self.decoder_config(), grain=self.grain)


class ReversibleCausalLM(PreTrainedModel, GenerationMixin):
    """The pipeline's layers in one module: ``embed``, ``blocks``, ``norm`` and ``head`` (absent when tied)."""

    config_class = PretrainedConfig
    base_model_prefix = "reversible"
    _supports_sdpa = True

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        specs = config.layer_specs()
        self.tied = isinstance(specs[-1], TiedLayerSpec)
        self.embed = specs[0].build()
        self.blocks = nn.ModuleList(spec.build() for spec in specs[1:-2])
        self.norm = specs[-2].build()
        self.head = None if self.tied else specs[-1].build()
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Each layer initialises its weights as it does in the pipeline, and loaded weights replace them; but
        ``from_pretrained`` builds on the meta device, so a rotary module's frequencies (a buffer no file holds)
        are recomputed by Hugging Face's own rule."""
        if "RotaryEmbedding" in type(module).__name__:
            super()._init_weights(module)

    def get_input_embeddings(self) -> nn.Module:
        return next(m for m in self.embed.modules() if isinstance(m, nn.Embedding))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, past_key_values: Any = None,
                use_cache: bool | None = None, labels: Tensor | None = None, cache: Any = None,
                **_: Any) -> CausalLMOutputWithPast:
        """``labels`` as Hugging Face's causal LMs take them: the inputs themselves (shifted here), -100 ignored.
        ``cache`` is transformers 5.24's name for ``past_key_values``."""
        past_key_values = past_key_values if past_key_values is not None else cache
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("a padded batch: the reversible models generate from prompts of one length "
                             "(pass them one at a time or without padding)")
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        start = past_key_values.get_seq_length() if past_key_values is not None else 0
        x = self.embed(input_ids, start)
        attention = 0  # the cache's layer index: layers that attend, in order (an MLP half does not)
        for block in self.blocks:
            if getattr(block, "attends", True):
                x = block(x, cache=past_key_values, layer=attention, start=start)
                attention += 1
            else:
                x = block(x)
        h = self.norm(x)
        logits = self.embed.logits(h) if self.tied else self.head(h)
        loss = None if labels is None else lm_loss(logits[:, :-1], labels[:, 1:])
        cache_out = {OUTPUT_CACHE: past_key_values if use_cache else None}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_out)

    @classmethod
    def from_layer_states(cls, config: PretrainedConfig, layer_states: Sequence[State]) -> "ReversibleCausalLM":
        """The model holding a pipeline's weights: ``layer_states`` in layer order (:func:`load_layer_files`)."""
        model = cls(config)
        expected = len(model.blocks) + 3
        if len(layer_states) != expected:
            raise ValueError(f"{len(layer_states)} layer states for a pipeline of {expected} layers")
        names = ["embed", *(f"blocks.{i}" for i in range(len(model.blocks))), "norm", "head"]
        state = {f"{name}.{key}": value for name, layer in zip(names, layer_states) for key, value in layer.items()
                 if not (model.tied and name == "head")}
        model.load_state_dict(state, strict=True)
        return model


class RevGPTForCausalLM(ReversibleCausalLM):
    config_class = RevGPTLMConfig


class DecoderForCausalLM(ReversibleCausalLM):
    config_class = DecoderLMConfig


def causal_lm(config: PretrainedConfig, checkpoint_dir: str) -> ReversibleCausalLM:
    """A :class:`RevGPTLMConfig` or :class:`DecoderLMConfig` model from a DeepSpeed pipeline checkpoint."""
    model_class = {RevGPTLMConfig: RevGPTForCausalLM, DecoderLMConfig: DecoderForCausalLM}[type(config)]
    specs = config.layer_specs()
    states = load_layer_files(checkpoint_dir, len(specs), tied_head=isinstance(specs[-1], TiedLayerSpec))
    return model_class.from_layer_states(config, states)


for _config, _model in ((RevGPTLMConfig, RevGPTForCausalLM), (DecoderLMConfig, DecoderForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModelForCausalLM.register(_config, _model, exist_ok=True)
