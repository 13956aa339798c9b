"""The one exception type users see: a problem with their input, told in one line."""


class UserError(Exception):
    """Bad input (config, data, a client's reply). The message names the problem and the fix.

    The command line prints it as one line and exits with code 2.
    """
