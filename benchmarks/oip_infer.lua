-- wrk script: one OIP v2 single-row JSON infer request (the fraud model's 18 features).
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"inputs":[{"name":"features","datatype":"FP32","shape":[1,18],"data":[0.00,0.05,0.10,0.15,0.20,0.25,0.30,0.35,0.40,0.45,0.50,0.55,0.60,0.65,0.70,0.75,0.80,0.85]}]}'
