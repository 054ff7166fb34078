"""``ttt-zoo convert``: a checkpoint (official or ours) to a Hugging Face Hub folder with a model card."""


def add_parser(sub) -> None:
    from ttt_zoo import hub
    hub.add_convert_parser(sub)
