"""``ttt-zoo push``: upload a converted Hub folder (or install it into the local Hub cache)."""


def add_parser(sub) -> None:
    from ttt_zoo import hub
    hub.add_push_parser(sub)
