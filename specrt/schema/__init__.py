"""What the parts of specrt say to each other, without torch: the model's config and its
families (arch/), the step graph's inputs and outputs (step_io), the step cuts an engine keeps
(step_cuts), a draft head's graph (head_io) and Medusa's tree (medusa_tree), and the files of
checkpoints and graphs (checkpoint_files, graph_files).

export/ writes graphs with torch and reads these; engines/ and runtime/ read them and never
import torch through them (the layering contracts in pyproject.toml)."""
