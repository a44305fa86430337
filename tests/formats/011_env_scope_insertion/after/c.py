class A:
    def run(self):
        return 1

    def stop(self):
        return 0

class B:
    x = 1
    def run(self):
        return 1

    def stop(self):
        return 0
