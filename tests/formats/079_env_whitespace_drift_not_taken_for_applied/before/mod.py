def has_commit():
    return False  


def other():
    return None
