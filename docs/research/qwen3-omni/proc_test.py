from transformers import AutoTokenizer, WhisperFeatureExtractor, Qwen3OmniMoeProcessor
tok = AutoTokenizer.from_pretrained("/tmp/omni-research/tiny-omni")
msgs = [{"role": "user", "content": [{"type": "text", "text": "Hello, world"}]}]
try:
    proc = Qwen3OmniMoeProcessor(image_processor=None, video_processor=None, feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tok, chat_template=tok.chat_template)
    out = proc.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    print("processor(None image/video) ids", out["input_ids"].tolist())
    out2 = proc(text=[tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)], return_tensors="pt")
    print("processor __call__ keys", list(out2.keys()), out2["input_ids"].tolist())
except Exception as e:
    import traceback; print("FAILED", type(e).__name__, str(e)[:400])
