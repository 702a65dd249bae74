"""What qwen-tts's talker prompt is made of, per request, observed while `model.generate` runs.

`Qwen3TTSForConditionalGeneration.generate` gets the ingredients as arguments (token ids, the
clone prompt, languages, speakers, the layout) and builds the prompt from them inline. Two of them
exist only inside it: the codec prefill (think / no-think, language id: which one depends on the
language and, for dialect speakers, on the speaker) and a custom voice's speaker id. Both pass
through the talker's codec embedding, so a forward hook on it sees them as the call makes them,
instead of difftest re-deriving qwen-tts's rules. The speaker embedding is taken where the talker
gets it: the return of `generate_speaker_prompt`, in the talker's dtype.

The assembled prompt (issue 57, item 5) is taken where the talker gets it: the `inputs_embeds` and
`attention_mask` of the talker's prefill forward (a forward pre-hook on the talker: the first call
with more than one row), each request's attended rows without the batch's left padding. In the
reference runner that is exactly what `generate` hands to `talker.generate`; in the CPU test engine,
whose planted prompt defects wrap `talker.generate`, it is what its talker received after them. Each
row is labelled with the ingredient qwen-tts puts there (`input_prompt_rows`, an index into
difftest.engines.capture.PROMPT_ROWS), from qwen-tts's own layout (`row_names`, read in its
`generate` and `generate_icl_prompt`) and the ingredient lengths recorded here; where those labels
do not count the rows the talker got, every row is labelled "unknown", never guessed.

The result, per request, is capture schema v3's `input_*` arrays (difftest/engines/capture.py):
the reference runner stores them with the reference, the CPU test engine in its captures (with
its planted defects applied: they are what its talker was really given).
"""

from __future__ import annotations

import numpy as np

from difftest.engines.capture import PROMPT_ROWS
from difftest.family import CODEBOOKS

# qwen-tts's chat templates: "<|im_start|>assistant\n" + text + "<|im_end|>\n<|im_start|>assistant\n" for the
# text (the prompt takes input_id[:, 3:-5]), "<|im_start|>assistant\n" + text + "<|im_end|>\n" for an
# in-context clone's reference text (ref_id[:, 3:-2]); the first 3 ids are the role rows.
ROLE_IDS, TEXT_TRAILER, REF_TEXT_TRAILER = 3, 5, 2


def row_names(n_instruct: int, n_prefill: int, speaker: bool, n_text_ids: int, icl: bool, n_ref_text_ids: int,
              ref_frames: int, non_streaming: bool) -> list[str] | None:
    """What each row of qwen-tts 0.1.1's talker prompt holds, in order (`Qwen3TTSForConditionalGeneration.
    generate`): the instruction's ids; the role rows (input_id[:, :3]); the codec prefill and the speaker
    over the text pad; the codec pad over the text's bos; then, for an in-context clone,
    `generate_icl_prompt`'s rows (non-streaming: reference text, text and its eos over the codec pad, then
    the codec bos and the reference frames over the text pad; streaming: the text stream summed with the
    codec bos and reference frames, row by row, as long as the codec side runs), else the first text
    token over the codec bos (streaming) or every text token and its eos over the codec pad and then the
    codec bos (non-streaming). None where the lengths do not fit that layout."""
    n_text = n_text_ids - ROLE_IDS - TEXT_TRAILER
    rows = ["instruction"] * n_instruct + ["role"] * ROLE_IDS + ["codec prefill"] * n_prefill
    rows += ["speaker"] * bool(speaker) + ["codec pad"]
    if n_text < 0 or n_prefill not in (3, 4):
        return None
    if icl:
        n_ref_text = n_ref_text_ids - ROLE_IDS - REF_TEXT_TRAILER
        if n_ref_text < 0 or ref_frames < 1:
            return None
        texts = ["reference text"] * n_ref_text + ["text"] * n_text + ["text eos"]
        codecs = ["codec bos"] + ["reference codes"] * ref_frames
        if non_streaming:
            rows += texts + codecs
        else:  # text_embed[:, :codec_lens] + codec_embed, or the text padded with the text pad to the codec's length
            rows += [f"{texts[j]} + {c}" if j < len(texts) else c for j, c in enumerate(codecs)]
    elif non_streaming:
        rows += ["text"] * n_text + ["text eos", "codec bos"]
    else:
        if n_text < 1:  # input_id[:, 3:4] would be the text's end, not a text token
            return None
        rows.append("text + codec bos")
    return rows if all(r in PROMPT_ROWS for r in rows) else None


def _ids(t) -> np.ndarray:
    if t is None:
        return np.zeros(0, np.int64)
    return t.detach().to("cpu").reshape(-1).numpy().astype(np.int64)


class PromptInputs:
    """Call `observe(model, generate, *args, **kwargs)` in place of `generate(*args, **kwargs)`;
    afterwards `items` holds one dict of input_* arrays per request of the call."""

    def __init__(self):
        self.items: list[dict] | None = None
        self._call = None  # the call in progress: (arguments, prefills, speaker ids, speaker embeddings)

    def layout_now(self) -> list[list[str] | None]:
        """Per request of the call in progress, qwen-tts's row labels (row_names) from the ingredients
        recorded so far: complete once the prompt is built, i.e. inside a wrapper of `talker.generate`
        (the CPU engine's prompt-row-moved finds the row it moves with it)."""
        if self._call is None:
            raise RuntimeError("no generate call in progress")
        return [item.pop("_rows") for item in self._items(*self._call)]

    def observe(self, model, generate, *args, **kwargs):
        import inspect

        bound = inspect.signature(type(model).generate).bind(model, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        cfg = model.config.talker_config
        starts = {int(cfg.codec_think_id), int(cfg.codec_nothink_id)}
        prefills, speaker_ids, embeds, prompts = [], [], [], []

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

        def talker_in(_module, _args, kw):
            # the talker's prefill: its forward's first call with the whole prompt (later steps get one row)
            e = kw.get("inputs_embeds")
            if not prompts and e is not None and e.ndim == 3 and e.shape[1] > 1:
                mask = kw.get("attention_mask")
                prompts.append((e.detach().to("cpu").clone(),
                                None if mask is None else mask.detach().to("cpu").clone()))

        hook = model.talker.get_input_embeddings().register_forward_hook(seen)
        talker_hook = model.talker.register_forward_pre_hook(talker_in, with_kwargs=True)
        model.generate_speaker_prompt = speaker_prompt  # an instance attribute shadows the method
        self._call = (a, prefills, speaker_ids, embeds)
        try:
            result = generate(*args, **kwargs)
        finally:
            hook.remove()
            talker_hook.remove()
            del model.generate_speaker_prompt
            self._call = None
        items = self._items(a, prefills, speaker_ids, embeds)
        if len(prompts) != 1 or prompts[0][0].shape[0] != len(items):
            raise RuntimeError(f"qwen-tts's talker got {len(prompts)} prompts (batch "
                               f"{prompts[0][0].shape[0] if prompts else 0}) for {len(items)} requests: the "
                               f"prompt code is not the one difftest knows (qwen-tts 0.1.1)")
        e, mask = prompts[0]
        for i, item in enumerate(items):
            rows = e[i] if mask is None else e[i][mask[i] != 0]
            names = item.pop("_rows")
            item["input_prompt_embeds"] = rows.float().numpy()
            item["input_prompt_dtype"] = np.array(str(e.dtype).removeprefix("torch."))
            item["input_prompt_rows"] = (np.array([PROMPT_ROWS.index(n) for n in names], np.int64)
                                         if names is not None and len(names) == len(rows)
                                         else np.zeros(len(rows), np.int64))  # "unknown": never guessed
        self.items = items
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
                "input_ref_codes": (_ids(clone["ref_code"][i]).reshape(-1, CODEBOOKS) if icl
                                    else np.zeros((0, CODEBOOKS), np.int64)),
                "input_codec_prefill": prefills[i],
                "input_speaker_id": (np.array([next(spk)], np.int64) if clone is None and speakers[i]
                                     else np.zeros(0, np.int64)),
                "input_speaker_embedding": (np.zeros(0, np.float32) if emb is None
                                            else emb.detach().to("cpu").float().reshape(-1).numpy()),
                "input_speaker_dtype": np.array("" if emb is None else str(emb.dtype).removeprefix("torch.")),
                "input_non_streaming": np.array(int(bool(a["non_streaming_mode"])), np.int64),
            })
            it = items[-1]
            it["_rows"] = row_names(len(it["input_instruct_ids"]), len(it["input_codec_prefill"]),
                                    bool(len(it["input_speaker_id"]) or len(it["input_speaker_embedding"])),
                                    len(it["input_text_ids"]), bool(icl), len(it["input_ref_text_ids"]),
                                    len(it["input_ref_codes"]), bool(a["non_streaming_mode"]))
        return items
