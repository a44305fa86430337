def has_commit():
    return True


def other():
    return None
