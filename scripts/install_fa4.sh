# Source on the lent GPU machine (bash), after scripts/fetch_fa4_wheels.sh here. A call that carries .fa4/first keeps
# its half of the archive in /tmp for the next one; a call that carries .fa4/second (and .whl) then installs
# FlashAttention-4 and the project's wheels into /tmp/site, once per machine, and exports the PYTHONPATH that
# imports them.
if [ -f .fa4/first/cu13.part0 ]; then
  mkdir -p /tmp/fa4 && cp .fa4/first/cu13.part0 /tmp/fa4/
fi
if [ -f .fa4/second/cu13.part1 ] && [ -f /tmp/fa4/cu13.part0 ]; then
  if [ ! -d /tmp/site/nvidia_cutlass_dsl/cu13 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl .fa4/second/*.whl
    # After pip: its --upgrade would replace the nvidia_cutlass_dsl folder these files join.
    cat /tmp/fa4/cu13.part0 .fa4/second/cu13.part1 | tar -xJ -C /tmp/site
  fi
  # The package's .pth file (which adds dsl_packages to the path) is not read from a PYTHONPATH folder.
  export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
fi
