"""vLLM-Omni 0.30.0, Qwen3-Omni, async_chunk: false: the talker -> code2wav hand-off gives code2wav the
talker's prefill placeholder (an all-zero frame) as its first frame, so every request's audio starts with
80 ms decoded from codes 0 and is one frame longer than the talker generated; with a codec EOS, the last
generated frame is also dropped.

No model, no server and no difftest: the real hand-off function fed the rows the talker's pooling output
holds (measured on a served tiny Qwen3-Omni: row 0 is the prefill's zero placeholder, row k+1 holds
frame k). Run it with vLLM-Omni's interpreter:

    .venv-vllm-omni/bin/python docs/findings/qwen3-omni-full-payload-zero-frame/repro.py
"""

import torch
from vllm_omni.model_executor.stage_input_processors.qwen3_omni import talker2code2wav_full_payload


class Request:
    def __init__(self, output_token_ids):
        self.request_id = "r0"
        self.output_token_ids = output_token_ids


def handed(frames: torch.Tensor, tokens: list) -> torch.Tensor:
    rows = torch.cat([torch.zeros(1, 16, dtype=torch.long), frames])  # what the talker's pooling output holds
    out = talker2code2wav_full_payload(None, {"codes.audio": rows}, Request(tokens))
    return torch.as_tensor(out["codes"]["audio"]).reshape(16, -1).T  # (F, 16), as code2wav reads it


torch.manual_seed(0)
frames = torch.randint(1, 2048, (6, 16))  # the 6 frames the talker generated; codebook 0 is its token
for name, last in (("stopped by its token budget", 1000), ("stopped by codec EOS", 2150)):
    tokens = frames[:, 0].tolist() + [last]  # the talker's output ids: one per frame, then its last token
    got = handed(frames, tokens)
    print(f"{name}: the talker generated {len(frames)} frames; code2wav got {len(got)}")
    print(f"  first frame handed on all zero: {not got[0].any()}")
    print(f"  codebook 0 handed on:   {got[:, 0].tolist()}")
    print(f"  the talker's tokens:    {frames[:, 0].tolist()}")
    ok = len(got) == len(frames) and torch.equal(got, frames)
    print(f"  code2wav got the talker's frames: {ok}")
