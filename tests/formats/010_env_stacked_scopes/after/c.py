class A:
    def run(self):
        return 1

    def stop(self):
        return 0

class B:
    def run(self):
        return 2

    def stop(self):
        return 0
