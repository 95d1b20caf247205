# The simulated GPU host: the debootstrapped base (see build-image) plus the fake GPU kit.
# Built by simhost/build-image with simhost/kit/ as the build context.
ARG BASE
FROM ${BASE}
COPY . /
RUN install -D -m 644 /usr/share/fake-inference/env.defaults /etc/fake-inference/env \
    && systemctl enable fake-inference.service ssh.service \
    && fake-gpu init --count 8 \
    && python3 -m compileall -q /usr/lib/python3/dist-packages/fake_gpu.py
ENV container=docker
# systemd shuts down in order on SIGRTMIN+3 (SIGTERM would make it re-execute itself).
STOPSIGNAL SIGRTMIN+3
CMD ["/lib/systemd/systemd"]
ARG INPUTS
LABEL moe-bench-simhost.inputs=${INPUTS} moe-bench-simhost.base=${BASE}
