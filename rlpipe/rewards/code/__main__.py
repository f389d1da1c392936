"""``python -m rlpipe.rewards.code``: print which sandbox protections this host offers, and why others are not."""
from rlpipe.rewards.code.host import describe_host

print(describe_host())
