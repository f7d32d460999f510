"""One input row's problem: its output row gets the message as its error, and the job goes on."""


class RowError(ValueError):
    pass
