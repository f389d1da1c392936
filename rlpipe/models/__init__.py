"""Models on disk and in memory: loading and saving policies, critics and reward models, and their adapters.

`loading` is the one loader of a model directory (a full checkpoint, or a LoRA adapter over its base)
and the one writer of checkpoints; `master_weights` keeps a bf16 checkpoint's float32 weights as the
low bits bf16 drops; `value_model` is the scalar-head model the PPO critic and the reward model share;
`critic` loads and saves the critic; `lora` holds the adapter directory format, training wrappers
and the merge for export.

May import torch, transformers, safetensors, peft (lora only), `rlpipe.data`, `rlpipe.config` and
`rlpipe.errors`; nothing that runs a stage, an engine or a training loop.
"""
