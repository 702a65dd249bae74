"""What qwen-tts's talker prompt is made of, per request, observed while `model.generate` runs.

`Qwen3TTSForConditionalGeneration.generate` gets the ingredients as arguments (token ids, the
clone prompt, languages, speakers, the layout) and builds the prompt from them inline. Two of them
exist only inside it: the codec prefill (think / no-think, language id: which one depends on the
language and, for dialect speakers, on the speaker) and a custom voice's speaker id. Both pass
through the talker's codec embedding, so a forward hook on it sees them as the call makes them,
instead of difftest re-deriving qwen-tts's rules. The speaker embedding is taken where the talker
gets it: the return of `generate_speaker_prompt`, in the talker's dtype.

The result, per request, is capture schema v3's `input_*` arrays (difftest/engines/capture.py):
the reference runner stores them with the reference, the CPU test engine in its captures (with
its planted defects applied: they are what its talker was really given).
"""

from __future__ import annotations

import numpy as np


def _ids(t) -> np.ndarray:
    if t is None:
        return np.zeros(0, np.int64)
    return t.detach().to("cpu").reshape(-1).numpy().astype(np.int64)


class PromptInputs:
    """Call `observe(model, generate, *args, **kwargs)` in place of `generate(*args, **kwargs)`;
    afterwards `items` holds one dict of input_* arrays per request of the call."""

    def __init__(self):
        self.items: list[dict] | None = None

    def observe(self, model, generate, *args, **kwargs):
        import inspect

        bound = inspect.signature(type(model).generate).bind(model, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        cfg = model.config.talker_config
        starts = {int(cfg.codec_think_id), int(cfg.codec_nothink_id)}
        prefills, speaker_ids, embeds = [], [], []

        def seen(_module, inputs, _output):
            ids = inputs[0]
            if ids.ndim == 0:  # torch.tensor(spk_id): a custom voice's speaker
                speaker_ids.append(int(ids))
            elif ids.ndim == 2 and ids.shape[0] == 1 and ids.shape[1] in (3, 4) and int(ids[0, 0]) in starts:
                prefills.append(_ids(ids))

        inner_speaker = model.generate_speaker_prompt

        def speaker_prompt(voice_clone_prompt):
            out = inner_speaker(voice_clone_prompt)
            embeds[:] = list(out)
            return out

        hook = model.talker.get_input_embeddings().register_forward_hook(seen)
        model.generate_speaker_prompt = speaker_prompt  # an instance attribute shadows the method
        try:
            result = generate(*args, **kwargs)
        finally:
            hook.remove()
            del model.generate_speaker_prompt
        self.items = self._items(a, prefills, speaker_ids, embeds)
        return result

    @staticmethod
    def _items(a: dict, prefills: list, speaker_ids: list, embeds: list) -> list[dict]:
        n = len(a["input_ids"])
        if len(prefills) != n:
            raise RuntimeError(f"qwen-tts built {len(prefills)} codec prefills for {n} requests: the prompt "
                               f"code is not the one difftest knows (qwen-tts 0.1.1)")
        clone = a["voice_clone_prompt"]
        speakers = a["speakers"] or [None] * n
        instruct = a["instruct_ids"] or [None] * n
        if clone is None and len(speaker_ids) != sum(1 for s in speakers if s):
            raise RuntimeError(f"qwen-tts embedded {len(speaker_ids)} speaker ids for "
                               f"{sum(1 for s in speakers if s)} requests with a speaker")
        spk = iter(speaker_ids)
        items = []
        for i in range(n):
            uses_embedding = clone is not None and (clone["x_vector_only_mode"][i] or clone["icl_mode"][i])
            icl = clone is not None and clone["ref_code"] is not None and clone["icl_mode"][i]
            emb = embeds[i] if uses_embedding else None
            items.append({
                "input_text_ids": _ids(a["input_ids"][i]),
                "input_instruct_ids": _ids(instruct[i]),
                "input_ref_text_ids": _ids(a["ref_ids"][i]) if icl else np.zeros(0, np.int64),
                "input_ref_codes": (_ids(clone["ref_code"][i]).reshape(-1, 16) if icl
                                    else np.zeros((0, 16), np.int64)),
                "input_codec_prefill": prefills[i],
                "input_speaker_id": (np.array([next(spk)], np.int64) if clone is None and speakers[i]
                                     else np.zeros(0, np.int64)),
                "input_speaker_embedding": (np.zeros(0, np.float32) if emb is None
                                            else emb.detach().to("cpu").float().reshape(-1).numpy()),
                "input_speaker_dtype": np.array("" if emb is None else str(emb.dtype).removeprefix("torch.")),
                "input_non_streaming": np.array(int(bool(a["non_streaming_mode"])), np.int64),
            })
        return items
