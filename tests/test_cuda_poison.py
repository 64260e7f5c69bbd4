"""The cuda_poison plugin, in a pytest run of its own (pytester): a sticky CUDA error names its test in the GPU tests
after it, which are not run (setup errors); other failures and CPU tests are left alone."""

pytest_plugins = ["pytester"]


def test_a_sticky_error_marks_the_later_gpu_tests_not_run(pytester):
    pytester.makepyfile(
        """
        import pytest

        def test_other_failure():
            raise RuntimeError("max |error| too large")

        @pytest.mark.gpu
        def test_after_an_ordinary_failure():
            pass

        @pytest.mark.gpu
        def test_faults():
            raise RuntimeError("CUDA error: an illegal instruction was encountered")

        @pytest.mark.gpu
        def test_later_gpu():
            pass

        def test_later_cpu():
            pass
        """
    )
    result = pytester.runpytest("-p", "cuda_poison", "-p", "no:cacheprovider", "-o", "markers=gpu")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_later_gpu*", "*not run: *::test_faults left this process*"])
