import json, copy, torch
torch.set_num_threads(1)
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
from transformers import Qwen3OmniMoeForConditionalGeneration
base = json.load(open("/tmp/omni-research/tiny_config.json"))
base["thinker_config"]["text_config"]["vocab_size"] = 151676  # smaller, faster; still >= highest special id
for path in [("talker_config", "spatial_merge_size"), ("talker_config", "text_config", "shared_expert_intermediate_size"), ("talker_config", "speaker_id")]:
    cfg = copy.deepcopy(base); d = cfg
    for p in path[:-1]: d = d[p]
    d.pop(path[-1])
    try:
        m = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**cfg)).eval()
        if path[-1] == "speaker_id":
            m.generate(input_ids=torch.tensor([[151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]]), return_audio=True, thinker_max_new_tokens=2, talker_max_new_tokens=3)
        print("without", ".".join(path), "-> OK")
    except Exception as e:
        print("without", ".".join(path), "->", type(e).__name__, str(e)[:160])
