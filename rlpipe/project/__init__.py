"""`rlpipe init`: a new project for a user's own model, prompt files and reward, ready for `dvc repro`.

Owns the making of a project directory: the pipeline (`pipeline`: dvc.yaml and params.yaml
derived from rlpipe's own, so every stage and default stays in one place), the copies of the
user's inputs (`sources`: model, prompt files in any supported format, reward module), and the
git + DVC set-up (`init`). It may import rlpipe.config, rlpipe.data, rlpipe.run.params_file (the
comment-keeping params editor) and rlpipe.rewards; nothing imports it but the CLI.
"""
