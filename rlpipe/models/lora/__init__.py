"""LoRA adapters as policies: the adapter directory format, loading it over its base, training and merging it.

What it owns: a LoRA policy on disk is a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) plus rlpipe's ``rlpipe.json``, which records the policy version and the
base model's path and content hash (`rlpipe.models.lora.adapter`, no torch). `rlpipe.models.lora.peft_model`
wraps a causal LM for training (``train.lora``), loads an adapter over its base and merges one for
export. Everything that accepts a model directory accepts an adapter directory through
`rlpipe.models.loading.load_model` (the one loader), so stages never branch on it beyond that.

What it may import: rlpipe.config, rlpipe.errors, rlpipe.data.io, and (peft_model only) rlpipe.models.loading,
torch, transformers and peft. Nothing in rlpipe/models/lora imports a stage or an engine.
See docs/lora.md.
"""
