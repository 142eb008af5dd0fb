def greet(greeting):
    return f"{greeting} from a package requirements.txt installed"
