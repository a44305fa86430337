def has_commit():
    return None


def other():
    return None
