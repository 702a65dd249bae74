"""Tiny byte-level BPE tokenizer with the real Qwen2/Qwen3-Omni ids for bytes (0..255), role words and specials."""
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from tokenizers.pre_tokenizers import ByteLevel
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/omni-research/tiny-omni"
def bytes_to_unicode():  # GPT-2 / Qwen2 byte order: ids 0..255 are exactly this order in Qwen2's vocab
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]; n = 0
    for b in range(256):
        if b not in bs: bs.append(b); cs.append(256 + n); n += 1
    return [chr(c) for c in cs]
vocab = {ch: i for i, ch in enumerate(bytes_to_unicode())}
assert vocab["Ċ"] == 198 and vocab["Ġ"] == 220
ROLE = {"user": 872, "assistant": 77091, "system": 8948}
SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|object_ref_start|>": 151646,
 "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649, "<|quad_start|>": 151650,
 "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
 "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
 "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
 "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665, "</tool_response>": 151666,
 "<think>": 151667, "</think>": 151668, "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<tts_pad>": 151671,
 "<tts_text_bos>": 151672, "<tts_text_eod>": 151673, "<tts_text_bos_single>": 151674, "<|audio_pad|>": 151675}
vocab.update(ROLE); vocab.update(SPECIAL)   # put them in the model vocab so added tokens keep these ids
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
from tokenizers import AddedToken
tok.add_tokens([AddedToken(w, normalized=False, special=False) for w in ROLE])
tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIAL])
CHAT_TEMPLATE = (
 "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
 "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
 "{%- for c in message['content'] %}{%- if c['type'] == 'text' %}{{- c['text'] }}"
 "{%- elif c['type'] == 'audio' %}{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
 "{%- elif c['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
 "{%- elif c['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}{%- endif %}{%- endfor %}{%- endif %}"
 "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
from transformers import Qwen2TokenizerFast
hf = Qwen2TokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
    unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=32768,
    extra_special_tokens={"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"})
hf.save_pretrained(OUT)
print(sorted(os.listdir(OUT)))
