"""The defects the CPU engine can plant (`--defect NAME`), each from a real vLLM-Omni bug family.

Every defect is a small switch at the one place where the real bug lived; the
rest of the engine is the clean path. Where each one acts:

- `ref-leak` (the seed: issue #4370, fixed by PR #4373; the fallback it rides on is
  still open as #4355). `make_omni_output` collapses every request's
  `codes.ref` into one last-writer-wins variable and emits it as a length-1
  list; `to_payload_element`'s by-position lookup
  (`element[idx] if idx < len(element) else element[0]`) then hands that one
  reference to every request of the batch. Each utterance's onset is decoded
  with another request's voice as left context. At concurrency 1 (one request a
  batch) the one reference is the request's own: invisible.
  Acts in: handoff.make_omni_output.
- `shared-rng` (PR #4869 / #4850: concurrent requests interleaving one global
  RNG; #4883 / PR #4889 per-row generators; #6361 seeded co-batch divergence).
  Sampled requests are batched together and draw from one generator, seeded
  once per batch with the first request's seed. The clean engine runs each
  sampled request alone with `torch.manual_seed(its seed)`. Visible with
  do_sample at concurrency > 1 only; greedy requests are unaffected.
  Acts in: the scheduler's batch key and engine._talker.
- `batch-mixup` (#4316 / PR #4415: MOSS-TTS stage 1 decoded request 0's codes
  for the whole batch; #1411 / #1417: offline batched Qwen3-TTS with
  `runtime_info[0]` / `audio_tensors[0]` hard-coded). The per-request lookup
  slices request 0's codes for every request; each keeps its own reference
  codes. Invisible at concurrency 1.
  Acts in: handoff.to_payload_element.
- `chunk-boundary` (#2439 / PR #2480: chunk-boundary noise from too little
  left context; raised 25 -> 72). The vocoder's chunked decode uses a left
  context of 4 frames instead of qwen-tts's 25. Visible whenever reference +
  generated codes exceed one 300-frame chunk (the audiobook suite), at any
  concurrency; the codes are untouched.
  Acts in: engine._vocoder.
- `ref-in-output` (#4421 / PR #4429: non-async voice clone leaked the reference
  audio into the output because the trim length travelled on a different
  channel). The stage input carries the trim under another key than the
  vocoder reads, so the reference part is never cut: the answer is longer by
  the reference's frames and starts with the reference re-synthesised. Any
  concurrency, in-context voice clones only.
  Acts in: handoff.talker2code2wav.
- `off-by-one` (vLLM-Omni's `talker2code2wav_full_payload` crops to
  `len(output_token_ids) - 1` frames; research §3 "Off-by-one at max-length
  stops"). Planted as: a request that stopped at max_new_tokens (no EOS) loses
  its last generated frame before the vocoder. The captured codes are one frame
  short and the audio 1920 samples short. Any concurrency.
  Acts in: handoff.talker2code2wav.

Talker defects at any concurrency (issue: teacher-forced scoring). The capture
reports what the request asked for, so only teacher forcing can see them:

- `prompt-truncated` (#3940 / PR #3940: a collapsed `ref_code` truncated the
  in-context prompt, so the speech ignored what it was given). The talker is
  prompted with the first 2 frames of the reference codes; the hand-off and the
  capture carry the whole reference. In-context voice clones only.
  Acts in: engine._talker (the prompt items).
- `prompt-padded` (#1553 / PR #1554: the ICL prompt-length estimate fell back to
  2048 and the talker attended to padding). 24 rows of the text pad embedding are
  put in front of every prompt, attended to. Every task.
  Acts in: engine._talker (talker.generate's inputs).
- `sampled-greedy` (decoding other than asked: a greedy request served with the
  deploy's sampling defaults). A greedy request's talker samples (temperature
  0.9, top-k 50, its seed). Greedy requests only.
  Acts in: engine._generate_kwargs.
- `codebook-shift` (the code predictor's outputs assigned to the wrong
  codebooks). Codebooks 1-15 of every frame are rotated by one before the
  hand-off and the capture. Every task.
  Acts in: engine._talker.
- `language-dropped` (the request's language never reaches the prompt: the
  talker gets no language tag, as for "Auto"). Every segment with a language.
  Acts in: engine._talker.
- `streaming-layout` (the prompt laid out in non-streaming mode, the whole text
  before the first frame, where streaming was asked, or the reverse). Voice
  clones (custom and designed voices lay the text out alike either way).
  Acts in: engine._generate_kwargs.
- `ref-audio-rate` (the reference audio's sample rate mistaken before the
  encoder: 24 kHz samples read as 22.05 kHz, a voice at another rate read at
  22050/24000 of it (48 kHz as 44.1 kHz), a stereo one mixed down first as
  qwen-tts does, so qwen-tts resamples them and the encoder sees the voice 9%
  slower). The talker, the capture and the hand-off
  all carry the encoder's (wrong) codes consistently: only the comparison with
  qwen-tts's encoder of the same voice sees it. In-context voice clones.
  Acts in: engine._prompt.
- `temperature-ignored` (a request's sampling parameters dropped for the deploy's
  defaults). A sampled request's talker draws at temperature 1.5, its top-k kept:
  every token stays inside the support, only the suite's likelihood shows it.
  Sampled requests only. Acts in: engine._generate_kwargs.
- `top-k-ignored` (sampling looser than asked). A sampled request's talker draws
  from the whole codebook, not its top-k. Sampled requests only.
  Acts in: engine._generate_kwargs.
- `top-k-narrowed` (sampling tighter than asked). A sampled request's talker
  draws from its top 5 instead of the top-k asked. Sampled requests only.
  Acts in: engine._generate_kwargs.

One per alternative of the sampling test's bank (issue #31, difftest/sampler_bank.py): each is
caught only by a suite with the power for it (`sampled-power`; report.json `sampling.power` says).
Sampled requests only; all act in engine._generate_kwargs.

- `talker-temperature-hot` / `talker-temperature-cold`: the talker draws at the asked temperature
  plus / minus 0.1 (a default or a rounded value served in place of the request's).
- `top-k-halved`: the talker draws from the top half of the top-k asked (25 for 50).
- `top-p-applied`: the talker draws from the nucleus of mass 0.8 where top-p 1.0 was asked (another
  deploy's default applied).
- `repetition-penalty-dropped` / `repetition-penalty-twice`: the talker's repetition penalty not
  applied, or applied twice (penalty squared): a processor left out of, or run twice in, the chain.
- `unprocessed-logits`: the talker draws from its raw logits (temperature 1, no top-k, no penalty).
- `subtalker-temperature-hot`: the code predictor draws at its temperature plus 0.1.

Defects in what the talker's prompt is made of (issue #29). The talker's input is captured
(schema v3), so these are named at stage `talker_input`, the field with them:

- `speaker-scaled` (a clone's speaker embedding altered on its way to the prompt: a dtype or
  normalisation slip). The x-vector is scaled by 0.9 before the talker; the reference codes are
  untouched. Voice clones. Acts in: engine._talker.
- `speaker-leak` (one request's speaker embedding conditions another's: the seed's family, on the
  speaker instead of the reference codes). Every voice clone of a batch gets the first one's
  x-vector. Invisible at concurrency 1. Acts in: engine._talker.
- `text-word-dropped` (text lost on its way to the prompt, as a truncation or a wrong slice
  would). The last word of each text is dropped before it is tokenised. Every task with two words
  or more. Acts in: engine._talker.

A defect in how the prompt is assembled, every ingredient right (issue 57, item 5): only the
assembled prompt, compared row by row (`input_prompt_embeds`), names it at stage `talker_input`:

- `prompt-row-moved` (an ingredient put in the wrong place: a concatenation in another order than
  qwen-tts's). Every prompt with a speaker row (a custom voice's speaker, a clone's x-vector) has it
  after the codec pad row instead of before it; the ingredients the capture records are all
  qwen-tts's. Custom voices and voice clones. Acts in: engine._talker (talker.generate's inputs).

A defect below every per-token line (issue #28), for the measured null (difftest/verdicts/null.py):

- `prompt-embeds-scaled` (the talker's prompt altered after the builder: a normalisation applied
  twice, an embedding cast through a narrower dtype, the family of #2274's fused kernels that made a
  release sound worse while every token stayed plausible). The prompt embeddings are scaled by 0.97
  on their way into the talker; the builder's inputs and the hand-off are untouched (the assembled
  prompt the capture takes at the talker's forward shows it: exact in float32). Every task.
  Acts in: engine._talker.

A concurrency defect below every per-token line (issue #28), for the null at N:

- `cobatch-blend` (what a co-batched request is conditioned on altered a little: state shared
  across a batch's rows, a mask or an offset off by a row, the family of the seed's leak without its
  size). Every request of a batch but the first has 3% of the first one's prompt embeddings blended
  into its own on their way into the talker. Exact at concurrency 1 (a batch of one); at N the
  codes part from those at 1 on near-ties and stay plausible. Acts in: engine._talker.

Where each lives upstream: docs/cpu-engine.md.
"""

from __future__ import annotations

from difftest.family import SAMPLE_RATE

DEFECTS: dict[str, dict] = {
    "ref-leak": {
        "family": ["#4370", "#4373", "#4355"],
        "summary": "one reference (last writer wins) handed to every request of a batch via the element[0] fallback",
        "concurrency_only": True,
    },
    "shared-rng": {
        "family": ["#4869", "#4850", "#4889", "#6361"],
        "summary": "sampled requests batched together draw from one generator seeded once per batch",
        "concurrency_only": True,
    },
    "batch-mixup": {
        "family": ["#4316", "#4415", "#1411", "#1417"],
        "summary": "request 0's codes decoded for every request of the batch",
        "concurrency_only": True,
    },
    "chunk-boundary": {
        "family": ["#2439", "#2480"],
        "summary": "vocoder chunked decode with 4 frames of left context instead of 25",
        "concurrency_only": False,
    },
    "ref-in-output": {
        "family": ["#4421", "#4429"],
        "summary": "the reference part of an in-context voice clone is not trimmed from the output",
        "concurrency_only": False,
    },
    "off-by-one": {
        "family": ["len(output_token_ids)-1 crop in talker2code2wav_full_payload"],
        "summary": "the last generated frame is dropped when a request stops at max_new_tokens",
        "concurrency_only": False,
    },
    "prompt-truncated": {
        "family": ["#3940"],
        "summary": "the talker is prompted with the first 2 frames of the reference codes",
        "concurrency_only": False, "talker": True,
    },
    "prompt-padded": {
        "family": ["#1553", "#1554"],
        "summary": "24 attended pad rows in front of every talker prompt",
        "concurrency_only": False, "talker": True,
    },
    "sampled-greedy": {
        "family": ["decoding other than asked"],
        "summary": "a greedy request's talker samples (temperature 0.9, top-k 50)",
        "concurrency_only": False, "talker": True,
    },
    "codebook-shift": {
        "family": ["code predictor outputs on the wrong codebooks"],
        "summary": "codebooks 1-15 rotated by one before the hand-off",
        "concurrency_only": False, "talker": True,
    },
    "language-dropped": {
        "family": ["the request's language lost before the prompt"],
        "summary": "the talker is prompted without the language tag",
        "concurrency_only": False, "talker": True,
    },
    "streaming-layout": {
        "family": ["prompt layout: non_streaming_mode"],
        "summary": "the prompt laid out in the other streaming mode than asked",
        "concurrency_only": False, "talker": True,
    },
    "ref-audio-rate": {
        "family": ["reference audio sample rate mistaken before the encoder"],
        "summary": "the voice's 24 kHz samples encoded as if 22.05 kHz (another rate: as if 22050/24000 of it)",
        "concurrency_only": False, "talker": True,
    },
    "temperature-ignored": {
        "family": ["per-request sampling parameters dropped"],
        "summary": "a sampled request's talker draws at temperature 1.5 (top-k kept)",
        "concurrency_only": False, "talker": True,
    },
    "top-k-ignored": {
        "family": ["per-request sampling parameters dropped"],
        "summary": "a sampled request's talker draws from the whole codebook (no top-k)",
        "concurrency_only": False, "talker": True,
    },
    "top-k-narrowed": {
        "family": ["sampling tighter than asked"],
        "summary": "a sampled request's talker draws from its top 5",
        "concurrency_only": False, "talker": True,
    },
    "talker-temperature-hot": {
        "family": ["per-request sampling parameters served wrong"],
        "summary": "a sampled request's talker draws at the asked temperature + 0.1",
        "concurrency_only": False, "talker": True,
    },
    "talker-temperature-cold": {
        "family": ["per-request sampling parameters served wrong"],
        "summary": "a sampled request's talker draws at the asked temperature - 0.1",
        "concurrency_only": False, "talker": True,
    },
    "top-k-halved": {
        "family": ["sampling tighter than asked"],
        "summary": "a sampled request's talker draws from the top half of its top-k",
        "concurrency_only": False, "talker": True,
    },
    "top-p-applied": {
        "family": ["sampling tighter than asked"],
        "summary": "a sampled request's talker draws from the nucleus of mass 0.8 (top-p 1.0 asked)",
        "concurrency_only": False, "talker": True,
    },
    "repetition-penalty-dropped": {
        "family": ["a logits processor left out or run twice"],
        "summary": "a sampled request's talker draws without its repetition penalty",
        "concurrency_only": False, "talker": True,
    },
    "repetition-penalty-twice": {
        "family": ["a logits processor left out or run twice"],
        "summary": "a sampled request's talker applies its repetition penalty twice (squared)",
        "concurrency_only": False, "talker": True,
    },
    "unprocessed-logits": {
        "family": ["a logits processor left out or run twice"],
        "summary": "a sampled request's talker draws from its raw logits (temperature 1, no top-k, no penalty)",
        "concurrency_only": False, "talker": True,
    },
    "subtalker-temperature-hot": {
        "family": ["per-request sampling parameters served wrong"],
        "summary": "the code predictor draws at its temperature + 0.1",
        "concurrency_only": False, "talker": True,
    },
    "speaker-scaled": {
        "family": ["speaker embedding altered before the prompt"],
        "summary": "a clone's speaker embedding is scaled by 0.9 before the talker",
        "concurrency_only": False, "talker": True,
    },
    "speaker-leak": {
        "family": ["another request's speaker embedding in the prompt"],
        "summary": "every clone of a batch is prompted with the first one's speaker embedding",
        "concurrency_only": True, "talker": True,
    },
    "text-word-dropped": {
        "family": ["text lost before the prompt"],
        "summary": "the last word of each text is dropped before tokenisation",
        "concurrency_only": False, "talker": True,
    },
    "prompt-row-moved": {
        "family": ["the talker's prompt assembled in another order than qwen-tts's (every ingredient right)"],
        "summary": "the speaker row comes after the codec pad row instead of before it",
        "concurrency_only": False, "talker": True,
    },
    "prompt-embeds-scaled": {
        "family": ["the talker's prompt altered after the builder (numerics worse, every token plausible)"],
        "summary": "the talker's prompt embeddings are scaled by 0.97 on their way in",
        "concurrency_only": False, "talker": True,
    },
    "cobatch-blend": {
        "family": ["another request's conditioning in a co-batched request's prompt, a little (the seed's family)"],
        "summary": "3% of a batch's first prompt is blended into every other request's prompt embeddings",
        "concurrency_only": True, "talker": True,
    },
}

TRUNCATED_REF_FRAMES = 2
EMBEDS_SCALE = 0.97
BLEND = 0.03
SPEAKER_SCALE = 0.9
HOT_TEMPERATURE = 1.5
NARROW_TOP_K = 5
TEMPERATURE_STEP = 0.1
NUCLEUS = 0.8
WRONG_RATE = 22050  # what ref-audio-rate takes a 24 kHz voice for
PADDED_ROWS = 24

# chunk-boundary: the vocoder's chunked decode, clean and defective.
DECODE_CHUNK_FRAMES = 300
DECODE_LEFT_CONTEXT = 25
DEFECT_LEFT_CONTEXT = 4


def wrong_rate(sample_rate: int) -> int:
    """The rate ref-audio-rate takes a voice of `sample_rate` for: 22050/24000 of it (22050 for 24 kHz)."""
    return round(sample_rate * WRONG_RATE / SAMPLE_RATE)


def check(name: str | None) -> str | None:
    """The defect name, validated (None: the clean engine)."""
    if name in (None, "", "none"):
        return None
    if name not in DEFECTS:
        raise ValueError(f"unknown defect {name!r} (known: {', '.join(DEFECTS)})")
    return name


def describe(name: str | None) -> dict | None:
    return None if name is None else {"name": name, **DEFECTS[name]}
