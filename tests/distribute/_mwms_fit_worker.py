import json, os, socket, subprocess, sys
def ports(n):
    ss=[socket.socket() for _ in range(n)]
    for s in ss: s.bind(("127.0.0.1",0))
    p=[s.getsockname()[1] for s in ss]
    for s in ss: s.close()
    return p
if len(sys.argv)==1:
    p=ports(2); procs=[]
    for i in range(2):
        env=dict(os.environ, TF_CONFIG=json.dumps({"cluster":{"worker":[f"127.0.0.1:{x}" for x in p]},"task":{"type":"worker","index":i}}), CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, __file__, str(i)], env=env))
    try:
        for q in procs: q.wait(timeout=120)
    finally:
        for q in procs:
            if q.poll() is None: q.kill()
    sys.exit(max(q.returncode or 0 for q in procs))
import numpy as np, tensorflow as tf, keras
keras.config.disable_traceback_filtering()
s=tf.distribute.MultiWorkerMirroredStrategy()
with s.scope():
    m=keras.Sequential([keras.layers.Dense(3)]); m.compile("adam","mse")
x=np.ones((16,4),"float32"); y=np.ones((16,3),"float32")
from tfmetal_ext.distribute import fit_compat
with fit_compat(s):
    m.fit(x,y,batch_size=8,epochs=1,verbose=2)
print("WEIGHTS", np.concatenate([w.ravel() for w in m.get_weights()]).round(6).tolist())
