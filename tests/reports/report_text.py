"""Texts the report tests record (imported by the tests and their conftest)."""

# every character is one byte token; with the tiny models' n_ctx of 24 it spans several windows
XSS_TEXT = "a<script>window.__xss=1</script>\"&'b & c <img src=x onerror=window.__xss=2> done"
