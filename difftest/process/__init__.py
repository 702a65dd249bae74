"""The process plumbing every engine and command stands on: starting servers and runners and waiting
for them (launcher, runner_client), tying their lives to difftest's (lifeline), forking runners from
an imported interpreter (zygote), and which process sees which GPU (placement)."""
