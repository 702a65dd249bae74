"""Experiment-only hook (stands in for a few lines in difftest's plugin): with DIFFTEST_OMNI_GREEDY_CP=1, make
vLLM-Omni's Qwen3-Omni code predictor ("stored" sampling mode) greedy by calling its own
set_sampling_params(top_k=1, top_p=1.0) after construction. Loaded via PYTHONPATH in every process;
patches the module right after it is first imported (post-import hook)."""
import importlib.abc, importlib.util, os, sys

TARGET = "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_code_predictor_mtp"

def _patch(mod):
    cls = mod.Qwen3OmniMoeTalkerCodePredictor
    if getattr(cls.__init__, "_greedy", False):
        return
    orig = cls.__init__
    def __init__(self, *a, **k):
        orig(self, *a, **k)
        self.set_sampling_params(top_k=1, top_p=1.0)
        print(f"[omni-cand hook] code predictor greedy: top_k={self._top_k} top_p={self._top_p} pid={os.getpid()}",
              file=sys.stderr, flush=True)
    __init__._greedy = True
    cls.__init__ = __init__
    if os.environ.get("DIFFTEST_OMNI_GREEDY_ARGMAX") == "1":
        # exact argmax (first maximal index, as torch/HF greedy): top_k=1 alone keeps every tied maximum
        # (bf16 logits tie often) and Gumbel noise from the global RNG then picks among them.
        cls._sample_codes_gumbel = classmethod(
            lambda c, logits, generator=None, uniforms=None: logits.float().argmax(dim=-1, keepdim=True))
        print(f"[omni-cand hook] code predictor: Gumbel replaced by argmax pid={os.getpid()}", file=sys.stderr, flush=True)

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        loader = spec.loader
        class L(importlib.abc.Loader):
            def create_module(self, s): return loader.create_module(s)
            def exec_module(self, m):
                loader.exec_module(m); _patch(m)
        spec.loader = L()
        return spec

if os.environ.get("DIFFTEST_OMNI_GREEDY_CP") == "1":
    sys.meta_path.insert(0, _Finder())

# --- experiment capture: with OMNI_CAND_DUMP=DIR, wrap the Qwen3-Omni hand-off functions by module attribute (the
# pipeline names them by dotted string and resolves them at run time, so a wrapper set at import is what runs) ---
PROC = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"

def _dump(kind, request, payload, extra=None):
    import json, time, torch
    d = os.environ["OMNI_CAND_DUMP"]; os.makedirs(d, exist_ok=True)
    rid = str(getattr(request, "external_req_id", None) or getattr(request, "request_id", None)
              or getattr(request, "req_id", None))
    def g(o, *p):
        for n in p:
            o = None if o is None else (o.get(n) if isinstance(o, dict) else getattr(o, n, None))
        return o
    codes = g(payload, "codes", "audio")
    if isinstance(codes, torch.Tensor): codes = codes.detach().cpu().reshape(-1).tolist()
    rec = {"kind": kind, "pid": os.getpid(), "t": time.time(), "rid": rid,
           "output_token_ids": [int(x) for x in (getattr(request, "output_token_ids", None) or [])],
           "prompt_len": len(getattr(request, "prompt_token_ids", None) or []),
           "codes": codes, "left_context_size": str(g(payload, "meta", "left_context_size")),
           "finished": str(g(payload, "meta", "finished"))}
    if extra: rec.update(extra)
    with open(f"{d}/{kind}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")

def _patch_proc(mod):
    import functools
    for name in ("talker2code2wav_full_payload", "talker2code2wav_async_chunk",
                 "thinker2talker_full_payload", "thinker2talker_async_chunk"):
        fn = getattr(mod, name)
        if getattr(fn, "_cand", False): continue
        def make(fn, name):
            @functools.wraps(fn)
            def w(*a, **k):
                r = fn(*a, **k)
                try:
                    req = k.get("request", a[2] if len(a) > 2 else None)
                    extra = {}
                    if name.startswith("thinker2talker") and r is not None:
                        import torch
                        def summ(o, path=""):
                            out = {}
                            if isinstance(o, torch.Tensor):
                                t = o.detach().float().cpu(); out[path] = [list(o.shape), float(t.sum()), float(t.abs().sum())]
                            elif isinstance(o, dict):
                                for kk, vv in o.items(): out.update(summ(vv, f"{path}.{kk}"))
                            elif hasattr(o, "__struct_fields__"):
                                for kk in o.__struct_fields__: out.update(summ(getattr(o, kk), f"{path}.{kk}"))
                            return out
                        extra["summary"] = summ(r); r_codes = None
                        _dump(name, req, {}, extra)
                    else:
                        _dump(name, req, r, extra)
                except Exception as e:
                    print(f"[omni-cand hook] dump failed {name}: {e!r}", file=sys.stderr, flush=True)
                return r
            w._cand = True
            return w
        setattr(mod, name, make(fn, name))
    print(f"[omni-cand hook] wrapped hand-off functions in pid={os.getpid()}", file=sys.stderr, flush=True)

class _Finder2(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != PROC:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        class L(importlib.abc.Loader):
            def create_module(self, s): return loader.create_module(s)
            def exec_module(self, m):
                loader.exec_module(m); _patch_proc(m)
        spec.loader = L()
        return spec

if os.environ.get("OMNI_CAND_DUMP"):
    sys.meta_path.insert(0, _Finder2())
