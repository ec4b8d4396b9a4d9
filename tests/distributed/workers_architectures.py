"""Workers for tests/distributed/test_architectures.py: vision, speech, contrastive and encoder-only models outside
the causal / masked / seq2seq LM classes the conformance matrix draws from. Module level so that spawn can pickle
them."""

from __future__ import annotations

from typing import Any

import torch


def family(name: str) -> tuple[Any, Any, dict[str, Any]]:
    """``(model class, tiny config with dropout off, fixed batch)`` of a family."""
    import transformers as T

    g = torch.Generator().manual_seed(3)
    tower = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    if name == "vit":  # the patch embedding (a Conv2d) inside a `_no_split_modules` block
        config = T.ViTConfig(**tower, image_size=16, patch_size=4, num_labels=3, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
        return T.ViTForImageClassification, config, {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                                                     "labels": torch.tensor([0, 2])}
    if name == "wav2vec2":  # no input embedding; a weight-norm parametrization (`original0` / `original1`)
        config = T.Wav2Vec2Config(**tower, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                  num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=20,
                                  hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                                  layerdrop=0.0, final_dropout=0.0, mask_time_prob=0.0, pad_token_id=0)
        return T.Wav2Vec2ForCTC, config, {"input_values": torch.randn(2, 800, generator=g),
                                          "labels": torch.randint(1, 20, (2, 5), generator=g)}
    text = {**tower, "vocab_size": 99, "max_position_embeddings": 16}
    vision = {**tower, "image_size": 16, "patch_size": 4}
    pair = {"input_ids": torch.randint(4, 99, (2, 16), generator=g), "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
            "return_loss": True}
    if name == "siglip":  # two towers, no input embedding at the root
        return T.SiglipModel, T.SiglipConfig(text_config=text, vision_config=vision), pair
    if name in ("clip", "clip_1d"):  # `logit_scale` has no dimension: fully_shard refuses it
        return T.CLIPModel, T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16), pair
    if name == "t5_encoder":  # `shared` tied to `encoder.embed_tokens`
        config = T.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=99, dropout_rate=0.0)
        return T.T5EncoderModel, config, {"input_ids": torch.randint(4, 99, (2, 8), generator=g)}
    raise KeyError(name)


def loss_of(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    out = model(**batch)
    return out.loss if getattr(out, "loss", None) is not None else out.last_hidden_state.float().pow(2).mean()


def adjust(name: str, model: torch.nn.Module) -> None:
    """What a user does to a family before ``prepare`` (``clip_1d``: the refused scalar made 1-D, as the error says)."""
    if name == "clip_1d":
        model.logit_scale = torch.nn.Parameter(model.logit_scale.detach().reshape(1))


def prepare_and_step(rank: int, world_size: int, *, name: str, model_dir: str, runs: tuple[str, ...]) -> dict[str, Any]:
    """Per run: the full parameters after ``prepare`` and after one AdamW step, the loss, or the error (and, for an
    error, whether this rank's weights were still real afterwards). ``transformer_based_wrap`` throughout. Runs:
    ``plugin`` (transformers' load on every rank, ``cpu_ram_efficient_loading``), ``plugin_memsafe_loader``
    (``accelerate_memsafe.from_pretrained``) and ``stock`` (accelerate alone, switched to FSDP as the plugin does on
    CPU, transformers' load on every rank)."""
    import accelerate
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    import accelerate_memsafe
    from accelerate_memsafe import Accelerator, MemSafePlugin, _compat

    cls, _, batch = family(name)
    out: dict[str, Any] = {}
    for run in runs:
        fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                     cpu_ram_efficient_loading=run == "plugin")
        if run == "stock":
            acc = accelerate.Accelerator(cpu=True, fsdp_plugin=fsdp_plugin)
            _compat.promote_state_to_fsdp(fsdp_plugin)
        else:
            acc = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=fsdp_plugin)
        model = (accelerate_memsafe.from_pretrained(cls, model_dir) if run == "plugin_memsafe_loader"
                 else cls.from_pretrained(model_dir))
        adjust(name, model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:  # torch's fully_shard checks some of what it refuses in the first forward (lazy init): the step too
            model, opt = acc.prepare(model, opt)
            after = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
            model.train()
            loss = loss_of(model, batch)
            loss.backward()
            opt.step()
            out[run] = {"after": after, "loss": loss.item(),
                        "stepped": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}
        except Exception as exc:  # noqa: BLE001 - the test reads which paths refuse, and how
            out[run] = {"error": f"{type(exc).__name__}: {exc}",
                        "still_real": not any(p.is_meta for p in model.parameters())}
        del acc, model, opt
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return out
