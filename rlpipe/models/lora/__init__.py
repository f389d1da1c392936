"""LoRA adapters as policies: the adapter directory format, training one, putting it over its base, merging it.

What it owns: a LoRA policy on disk is a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) plus rlpipe's ``rlpipe.json``, which records the policy version and the
base model's path and content hash (`rlpipe.models.lora.adapter`, no torch). `rlpipe.models.lora.peft_model`
wraps a causal LM for training (``train.lora``), puts an adapter over a loaded base and saves one;
`export` merges one for serving. Loading a base and its adapter is `rlpipe.models.loading`'s: everything
that accepts a model directory accepts an adapter directory through `load_model` (the one loader), so
stages never branch on it beyond that.

What it may import: rlpipe.config, rlpipe.errors, rlpipe.data.io, torch, transformers and peft, and (export
only) rlpipe.models.loading. Nothing in rlpipe/models/lora imports a stage or an engine.
See docs/lora.md.
"""
