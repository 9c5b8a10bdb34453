"""The sandbox service: runs untrusted Python (model-written code, unit tests
against it) isolated per execution, for tasks and environments that need code
executed (python_tool, code_tests, coding_agent). The core (types, executor,
pool, service) never imports gRPC; server.py is transport, client.py the one
interface callers use, in-process or remote."""
