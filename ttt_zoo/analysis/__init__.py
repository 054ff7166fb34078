"""Linear-attention forms of the TTT mixers and attention maps ("TTT with KV binding is secretly linear attention")."""
