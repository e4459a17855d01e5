"""The names each loss accepts: the config declares its choices from these (no torch here)."""

# surrogate + aggregation
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # sequence: GSPO
SCALE_REWARDS = ("group", "batch", "none")  # the std an advantage is divided by
# the baseline (verl's names)
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "sigmoid_norm", "robust", "exo_pair",
                  "nca_pair", "bco_pair",
                  "sppo_hard", "apo_zero", "apo_down", "discopop", "aot", "aot_unpaired", "sft")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
# TRL 1.16's names
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
VLLM_MODES = ("colocate",)  # an engine inside each training process
# how a tool call is written (rollout/tools.py)
TOOL_CALL_FORMATS = ("auto", "hermes", "llama3", "glm4")
