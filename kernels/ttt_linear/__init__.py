from .reference import (inner_rope, ln_l2_grad, token_tau, ttt_linear_bidir, ttt_linear_bidir_reference,
                        ttt_linear_naive, ttt_linear_reference)

__all__ = ["ttt_linear_reference", "ttt_linear_naive", "ttt_linear_bidir", "ttt_linear_bidir_reference", "ln_l2_grad",
           "inner_rope", "token_tau"]
